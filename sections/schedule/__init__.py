"""What a step runs, decided in plain Python (no TensorFlow at load): the policy registry, the schedule and its
program, the planner, the partition.
"""
