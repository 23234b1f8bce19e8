"""The trainers: compiled section functions, the shared Trainer, the Engine (it executes the schedule's program),
the baselines, FLOPs per section, SectionedModel (Keras fit).
"""
