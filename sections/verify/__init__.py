"""A step compared with an ordinary whole-graph step."""
