"""Serving one model call: translate, dispatch, capture, reply.

The call's path through the front end (``serve``), its one kept-alive stream (``stream``),
the capture step, and what is recorded beside the ids: request traits, policy version and
the collision watch.
"""
