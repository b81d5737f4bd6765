"""The thinker's TP group and start-up: one rank's start (`startup`), the group's control plane
(`distributed`: plans, agree-min, first failure, deadlines; `tp_store`, `peer_watch`), the worker
ranks' plan loop (`worker`), KV sizing (`kv_profile`), warm-up (`warmup`), local rank processes
(`local_ranks`) and the fault hook (`faults`). The step engine itself is `engine/`."""
