"""Pictures for the course: every function returns a matplotlib Figure.

Modules are named after the concept they draw (``viz.accounting``, ``viz.blocks`` ...).
"""
