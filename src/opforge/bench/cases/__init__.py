"""Bench cases, one module per op family (``@register("<family>")`` in each).

:func:`opforge.bench.registry.families` imports every module here; the op
package itself never imports the benchmark.
"""
