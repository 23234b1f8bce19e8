"""The config: its typed schema (defaults read from conf/), checks before anything heavy loads, overrides, resumed
configs.
"""
