"""Reward functions, referenced by registered name or `module:function`."""
