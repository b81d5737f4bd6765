"""The omnistage stage services: one sub-package per service; none imports another."""
