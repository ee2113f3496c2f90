"""The RL stage (PPO, GRPO, RLOO, REINFORCE++): the stage loop, one step, and the experience
records a step is built from.

Owns: stage, step, experience.
"""
