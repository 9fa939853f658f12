"""The TE-version-checked layer: everything te_integration takes from
TransformerEngine is imported and checked here (``_compat`` for TE's
modules, ``_compat_ops`` for ``te.ops``, ``_te_source`` for the checks that
read TE's source). Nothing here imports ``runtime`` or ``kinds``.
"""

__all__: list[str] = []
