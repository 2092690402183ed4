"""The way a scenario goes through, between the controller and judge below and the presentation
above: plan and preflight, run, judge, and the result document written."""
