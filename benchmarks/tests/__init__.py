"""CPU tests of the benchmarks' own code: arguments, plans, summaries and
their targets on synthetic samples, JSON and Markdown output, the plots,
the cProfile tables and the attribution timeline; ``policy_overhead --quick``
end to end. ``python3 -m pytest`` from the repository root runs them with
the rest (``testpaths`` in pyproject.toml)."""
