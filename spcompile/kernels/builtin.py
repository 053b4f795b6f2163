"""Imports the shipped templates so that they register themselves."""
import importlib

for _name in ("spcompile.kernels.tvm.cpu_csr", "spcompile.kernels.tvm.cuda_csr",
              "spcompile.kernels.csr.template", "spcompile.kernels.cusparse", "spcompile.kernels.scipy_ext",
              "spcompile.kernels.tc.template", "spcompile.kernels.aspt.template",
              "spcompile.kernels.sptc.template", "spcompile.kernels.window.template"):
    try:
        importlib.import_module(_name)
    except ModuleNotFoundError as e:  # a template family not present yet; a broken one still fails
        if e.name != _name:
            raise
