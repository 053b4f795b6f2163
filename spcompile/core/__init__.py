"""Core types: the IR, formats, numerics, the float64 reference and Config."""
