#!/bin/sh
# An interpreter that never answers: records its pid in $SILENT_PID_FILE, then sleeps.
echo $$ > "$SILENT_PID_FILE"
exec sleep 600
