"""The stages of a stream, one Grain step each, in the order a batch meets them: plan
(`plan.py`), read (`read.py`, on `ahead.py`'s threads), decode (`decode.py`), finish
(`finish.py`, with `errors.py`'s policy), hand-off from worker processes (`handoff.py`), and
the outermost stream (`stream.py`); `stats.py` records what each did."""
