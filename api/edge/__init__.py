"""The edge of the front end: what every request passes before and after its route.

Middleware (the rollout prefix, keys), body limits and JSON parsing, the one error map,
the hang-up check and the metrics.
"""
