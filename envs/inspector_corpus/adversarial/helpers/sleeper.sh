#!/bin/sh
# A background job that sleeps, then appends through an fd it opened when it
# started (adversarial corpus helper):  sh /opt/a/sleeper.sh FILE TEXT &
# Its sleep is killed (pkill -f "sleep 99999") to make it write: no timers, so a
# restored copy of it waits just as long as the original.
exec 3>>"$1"
sleep 99999
printf '%s\n' "$2" >&3
