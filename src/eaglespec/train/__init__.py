"""Training EAGLE-3 heads: prompts (data), target-regenerated responses (regen), captured target
features (features), the draft vocabulary (vocab), the training-time-test forward and loss (ttt),
the optimisation loop (trainer) and the end-to-end command (pipeline)."""
