"""Row-window SpMM with the window's X rows staged in shared memory (``csr.window``)."""
