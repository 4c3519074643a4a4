"""`infertune tune` (SLO-driven batch tuner) and `infertune ledger` (the step-by-step optimization table).

recommend.py holds the pure decision logic (unit-tested on synthetic tables); measure.py runs the engine and
HF transformers; command.py and ledger.py are the two CLI tools (each exposes add_arguments(parser) / run(args)).
"""
