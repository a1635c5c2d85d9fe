"""CPU, ISA and cache detection; block sizes; nominal and measured peak."""
from tilegemm.tuning.machine import Machine, detect
