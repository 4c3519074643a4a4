"""Diagnosis tools: `doctor` (versions, compatibility matrix, CPU, threads), `audit` (aten ops vs a backend's
op table), `debug-layers` (first module to go NaN or drift from fp32). Tool layer: imports anything, imported by
nothing but the CLI."""
