"""Settings shared by the project's own tests.

* the suite's Hypothesis profile (deadline off, derandomized), also in CI where ``CI=true`` would
  otherwise load Hypothesis' own ``ci`` profile;
* one torch thread per process: the tests run many small ops, often under xdist, where spinning
  OpenMP threads of several processes on two cores cost more than they bring (measured 13× slower).
"""

import torch

from conformance import hypothesis_profile

hypothesis_profile.load()
torch.set_num_threads(1)
