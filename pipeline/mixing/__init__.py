"""A mixture's run-time pieces (`pipeline.mixture` builds them): its plan and decode stages
(`stages`) and its outermost iterator (`stream`)."""
