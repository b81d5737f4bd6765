"""The thinker's TP ranks starting up: one rank's start (`startup`, which builds rank 0's step
engine), KV sizing (`kv_profile`), warm-up (`warmup`), the worker ranks' plan loop (`worker`) and
the fault hook (`faults`). Uses `engine/` and `tp/`; the engine never imports it."""
