"""CUDA C++ kernel templates (*.cu) and the Python that renders, compiles and launches them."""
