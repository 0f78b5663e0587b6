"""Course machinery (layer 6): what turns notebooks into a graded course.

- `outline`: the course map (one source for the README, the welcome notebook, `labkit course`).
- `exercises`: generates exercises/ from solutions/ (markers, stubs, forbid lists, the sync
  check); `committed` reads the committed copies (a learner's edits never fail the sync check)
  and backs up an edited exercise before it is regenerated.
- `grader`: `grade_notebook`, which runs the learner's answer cells inside the trusted template;
  `learner` reads the learner's file (a damaged one is refused with a message); `kernel`
  executes the graded notebook cell by cell with a hard time limit and capped output; `seal`
  keeps what the checks use out of the answers' reach; `report` holds the results.
- `grading`: the checks that template cells call; each says what is wrong, with numbers.
  `reference` computes their references; `forbid` refuses answers that call what they must
  write (labkit's own function, a collective in the ring exercise) or read solutions/.
- `doctor`: is this machine ready for the course?
- `workshop`: a workshop room's preflight (GPUs, NCCL, interconnect, all-reduce busbw, disk, every
  lab timed; the runs in `course_labs`) and its GPU-hour budget (`budget`).

May import: every lower layer (cost models, views, runtime, parallel, labs). Never cli/.
"""
