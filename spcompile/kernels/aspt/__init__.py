"""ASpT tiled SpMM: aspt.tiled."""
