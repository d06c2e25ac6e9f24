"""What the ranks of a process group say to each other: :mod:`.control` (the private gloo group a
group save, a group load and retention run their small messages over, the ranks' sizes and the
writer map). Below saving/ and loading/, which both import it; it imports neither."""
