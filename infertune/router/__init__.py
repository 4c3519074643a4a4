"""`infertune router`: prefill/decode disaggregation and data parallel in front of infertune servers (app.py)."""
