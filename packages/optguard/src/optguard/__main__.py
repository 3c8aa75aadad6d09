"""``python -m optguard build``: compile the native checks ahead of time (see native.py);
``python -m optguard status``: which checks a process would run, and why."""

from optguard.native import main

raise SystemExit(main())
