"""Request traces, the requests drawn from them and their arrival times (torch-free): one
implementation used by the planner, ``kvledger bench serve`` and the simulator."""
