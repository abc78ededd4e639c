"""Workflow traces: formats, validation, importers, workload generators and the dataset store."""
