"""Parts of ``benchmarks.engine_throughput``: the workload, the systems it drives, the decode roofline."""
