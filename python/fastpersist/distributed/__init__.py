"""What the ranks of a process group say to each other. Below saving/ and loading/, which both import it; it imports
neither.

* :mod:`.control`: the private gloo group a group save, a group load and retention run their small messages over
  (with ``Config.timeout_s``), the ranks' sizes and the writer map;
* :mod:`.watch`: one plain connection to every peer, so that a killed rank is noticed at once;
* :mod:`.placement`: the nodes, and the ring of partners that says where a rank's copies go;
* :mod:`.transfer`: a share's files sent between ranks over the control group, checked on both ends.
"""
