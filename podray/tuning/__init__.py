"""Ray Tune studies over podray runs: `podray tune tune_configs/NAME.yaml`.

  load_study(path, overrides) -> StudySpec    read and validate a study YAML (no Ray, no trial)
  run_study(spec, storage)    -> StudyResult  run it with ray.tune.Tuner; write table, CSV/JSON, plots
  resume_study(study_dir)     -> StudyResult  Tuner.restore an interrupted study and finish it

spec.py holds the study's values and checks every trial it can produce, parse.py reads the YAML,
trainable.py is the Tune function trainable (a trial is an ordinary podray.training.train run with a
Tune reporting sink), study.py builds the Tuner, report.py writes the outputs. Importing this package
imports neither Ray nor JAX.
"""

from podray.tuning.parse import load_study
from podray.tuning.spec import StudySpec
from podray.tuning.study import StudyResult, resume_study, run_study

__all__ = ["StudyResult", "StudySpec", "load_study", "resume_study", "run_study"]
