"""Presentation: the command line, tables and reports."""
