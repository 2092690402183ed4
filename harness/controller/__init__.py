"""Controller: lease ports, launch ranks, watch them, collect their results."""
