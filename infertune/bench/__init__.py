"""Benchmarks run against a live server (`infertune bench ...`)."""
