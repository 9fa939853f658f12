"""The kind-independent runtime: the call record, the module state and
levers, the Function and fuser seam bodies, the drop-ins' mixins, install,
the quantize seam, release and rebuild, attribution, the budget and the
registry of kinds (``_kind_registry``), from which every per-kind list is
derived. Nothing here imports ``kinds`` or names a kind
(``tests/unit/test_import_graph.py``).
"""

__all__: list[str] = []
