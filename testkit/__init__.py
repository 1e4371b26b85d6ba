"""What tests and benchmarks share: a local S3 server, traffic clients, port and Serve-cluster helpers,
the elastic fleet's setup.

It lives apart from both so the product's tests import nothing from ``benchmarks/`` and the
benchmarks import nothing from ``tests/``: each side depends on this package only. It may import
the product packages (pool, engine, routing, deployments), never ``tests`` or ``benchmarks``.
"""
