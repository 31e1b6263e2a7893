"""tokcap's tools for trying and testing it, apart from the product: the child processes the
demo and the tests start (``processes``), a local durable ``redis-server`` and Redis Cluster
(``redis_server``, ``redis_cluster``) and ``tokcap demo`` (``demo``). With the development
engine (``engine``) they install as ``tokcap-devtools``; a front-end or worker install does
not pull them in.
"""
