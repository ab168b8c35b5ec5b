"""The job's tasks and rewards: the token-class and calculator demo tasks, prompts read from a
dataset file, and verl-style text rewards."""
