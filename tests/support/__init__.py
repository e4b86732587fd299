"""What the tests share: origins (:mod:`.origins`), the proxy subprocess (:mod:`.proxy`),
waiting on a condition (:mod:`.wait`), test data (:mod:`.data`), a client that tells a
clean end from a broken one (:mod:`.faultclient`), store faults (:mod:`.store_faults`),
the operator tests' servers (:mod:`.opshelpers`) and the tar pipeline's
(:mod:`.pipeline_helpers`). Fixtures built on them live in ``tests/conftest.py``.

Test modules import from here, never from one another."""
