//! Process helpers every layer may use, and which use no other part of sluice: the clock a
//! calendar quota reads (`clock`), a connection's last activity for idle timeouts
//! (`activity`), a file watched for changes (`file_watch`, the policy's and the listener
//! certificate's), and background tasks that end with the process (`worker`).

pub mod activity;
pub mod clock;
pub mod file_watch;
pub mod worker;
