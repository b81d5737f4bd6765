"""The thinker's TP group as the engine sees it: the step plan's wire format (`plan`), plans,
agreement and the first failure (`distributed`), the group's store (`tp_store`), peer liveness
(`peer_watch`). Below `engine/` and `group/`; imports neither."""
