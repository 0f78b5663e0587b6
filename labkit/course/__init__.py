"""Course machinery (layer 6): what turns notebooks into a graded course.

- `exercises` (+ `committed`): exercises/ generated from solutions/; `outline`: the course map.
- `grader` (+ `learner`, `kernel`, `seal`, `report`): `grade_notebook`, the learner's answers run
  inside the trusted template; `grading` (+ `reference`, `forbid`, `pp_schedules`): the checks
  template cells call.
- `doctor`: is this machine ready? `workshop` (+ `course_labs`, `budget`): a room's preflight.
What each does: docs/runtime.md.

May import: every lower layer (cost models, views, runtime, parallel, labs). Never cli/.
"""
