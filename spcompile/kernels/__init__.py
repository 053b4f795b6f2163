"""Kernel templates: the Template protocol and the TVM TensorIR schedules."""
from .base import Kernel, Template, get_template, list_templates, register_template

__all__ = ["Kernel", "Template", "get_template", "list_templates", "register_template"]
