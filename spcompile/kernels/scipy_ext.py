"""``extern.scipy``: SciPy's CSR product as a CPU template (the CPU counterpart of
``extern.cusparse``), so that the module ``build()`` picks on the CPU is never slower than the
library a user would otherwise call."""
from __future__ import annotations

import numpy as np

from ..core.ir import SparseModule
from ..core.numerics import DTYPES
from ..runtime.kernel import Kernel
from .base import Template, check_csr_arrays, meta_equal, register_template


def _host_view(a):
    """A numpy view of a host array (numpy or torch CPU tensor), writable where ``a`` is."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "numpy"):
        return a.numpy()
    return np.asarray(a)


class ScipyKernel(Kernel):
    """``Y = A @ X`` by SciPy's CSR kernel, single-threaded, written into ``out``.  ``data`` is
    read at every call, so the module's call-time values (``mod(X, values=v)``, written into it in
    place) take effect.  Mean multiplies by the values divided by their rows' lengths, computed
    when the values are written (:meth:`values_written`), never a pass over the m x K output at
    every call (that pass cost a third of the call on tu_nci1 at K=64)."""

    target = "cpu"

    def __init__(self, template, params, arrays, files, meta):
        super().__init__(template, params, arrays, files, meta)
        a = self.arrays
        self._shape = tuple(int(v) for v in self.meta["shape"])
        self._lens = self._scaled = None
        if self.meta.get("reduce") == "mean":   # each stored entry's row length (never 0)
            lens = np.diff(np.asarray(a["indptr"], np.int64))
            self._lens = np.repeat(lens, lens).astype(a["data"].dtype)
            self.values_written()
        try:  # SciPy's own CSR x dense kernel, accumulating into a caller-owned output
            from scipy.sparse import _sparsetools

            self._matvecs = _sparsetools.csr_matvecs
        except (ImportError, AttributeError):  # pragma: no cover - other SciPy layouts
            self._matvecs = None

    def values_written(self) -> None:
        """Mean: the values divided by their rows' lengths, again (the module wrote ``data``)."""
        if self._lens is not None:
            self._scaled = np.divide(self.arrays["data"], self._lens)   # a new array: a call reads one whole set

    def __call__(self, *inputs, out):
        X = _host_view(inputs[0])
        Y = _host_view(out)
        a = self.arrays
        data = a["data"] if self._lens is None else self._scaled
        (m, n), K = self._shape, X.shape[1]
        if self._matvecs is not None and X.dtype == data.dtype and Y.dtype == data.dtype and X.flags.c_contiguous \
                and Y.flags.c_contiguous:
            Y.fill(0)
            self._matvecs(m, n, K, a["indptr"], a["indices"], data, X.ravel(), Y.ravel())
        else:
            import scipy.sparse as sp

            Y[...] = sp.csr_matrix((data, a["indices"], a["indptr"]), shape=(m, n), copy=False) @ X
        return out


@register_template
class Scipy(Template):
    """SciPy's CSR SpMM (sum and mean; float32, or float64 throughout for float64 workloads) as a
    CPU candidate: quick selection and the tuner offer it beside the compiled kernels, so a CPU
    module is never slower than ``A @ X`` in SciPy.  Works on the original matrix (passes do not
    apply to a library call).  Its ``data`` is the matrix values unchanged (mean divides them by
    the row lengths whenever they are written), so its modules take call-time values like the
    compiled CPU templates: whichever CPU template a build picks, ``mod(X, values=v)`` works."""

    name = "extern.scipy"
    version = "2"
    target = "cpu"
    priority = 1
    ops = (("spmm", "sum"), ("spmm", "mean"))
    dtypes = ("float32", "float64")
    #: not a tuning candidate: the tuner measures SciPy as its baseline in every run and stores
    #: nothing slower than it, and on a database miss quick selection offers it
    tunable = False

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("scipy") is not None

    def pipelines(self, mod):
        return [[]]

    def build(self, mod: SparseModule, params):
        params = self.check_params(mod, params)
        A = mod.op.A  # caller's order: the library needs no permutation folding
        vt = DTYPES[mod.op.dtype].compute   # the values in the workload's arithmetic type
        data = np.array(A.data, dtype=vt)
        idx = np.int32 if max(A.nnz, A.shape[1]) < 2**31 else np.int64
        arrays = {"indptr": np.array(A.indptr, dtype=idx), "indices": np.array(A.indices, dtype=idx), "data": data}
        meta = {"op": "spmm", "reduce": mod.op.reduce, "shape": list(A.shape)}
        return ScipyKernel(self.name, params, arrays, {}, meta)

    def check_arrays(self, key, params, arrays, meta, values=None):
        """The matrix's CSR arrays, the values unchanged in the workload's arithmetic type."""
        if sorted(arrays) != ["data", "indices", "indptr"]:
            raise ValueError(f"template {self.name!r} takes arrays ['data', 'indices', 'indptr'], got {sorted(arrays)}")
        meta_equal(meta, "shape", [key.rows, key.cols])
        check_csr_arrays(arrays, key.rows, key.cols, key.nnz, pattern=key.pattern,
                         values=values, value_dtype=DTYPES[key.dtype].compute)

    def load(self, params, arrays, files, meta):
        return ScipyKernel(self.name, params, arrays, files, meta)
