"""Memory, in one room by role: planning (``plan``), the hard limits (``guard``), a rank's
sampling (``sampler``) and share (``share``), and judging (``judging``). It imports nothing of the
harness but the protocol, so both sides of the process boundary read it."""
