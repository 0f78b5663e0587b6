"""Course machinery (layer 6): what turns notebooks into a graded course.

- `outline`: the course map (one source for the README, the welcome notebook, `labkit course`).
- `exercises`: generates exercises/ from solutions/ (markers, stubs, the sync check).
- `grader`: `grade_notebook`, which runs the learner's answer cells inside the trusted template.
- `grading`: the checks that template cells call; each says what is wrong, with numbers.
- `doctor`: is this machine ready for the course?

May import: every lower layer (cost models, views, runtime, parallel, labs). Never cli/.
"""
