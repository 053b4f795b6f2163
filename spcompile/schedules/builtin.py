"""Imports the shipped templates so that they register themselves."""
import importlib

for _name in ("spcompile.schedules.cpu_csr", "spcompile.schedules.cuda_csr",
              "spcompile.cuda_templates.templates",
              "spcompile.cuda_templates.tc_wmma_sgt", "spcompile.cuda_templates.aspt_tiled",
              "spcompile.cuda_templates.sptc_vnm"):
    try:
        importlib.import_module(_name)
    except ModuleNotFoundError as e:  # a template family not present yet; a broken one still fails
        if e.name != _name:
            raise
