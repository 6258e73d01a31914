//! A step as `srun` describes it, for `worker --slurm`: this task's rank,
//! the run's size, the node list (SLURM's compressed hostlist, expanded),
//! how many tasks each node runs, the rendezvous (rank 0's node) and a port
//! derived from the job id, and which of the node's GPUs this task takes.
//!
//! Pure: every function reads SLURM's variables through a `var` closure and
//! returns values or an error naming the variable, its value and what was
//! expected; nothing here touches the process's environment or the network.
//!
//! What srun sets per task (Slurm's srun(1), "OUTPUT ENVIRONMENT VARIABLES"):
//! SLURM_PROCID (the task's global rank), SLURM_NTASKS (tasks in the step),
//! SLURM_LOCALID (the task's rank on its node), SLURM_NODEID (its node's
//! index in the step's node list), SLURM_STEP_NODELIST (the step's nodes;
//! SLURM_JOB_NODELIST / SLURM_NODELIST are the allocation's, which may hold
//! more), SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (`2(x3),1`: two
//! tasks on each of the first three nodes, one on the fourth), SLURM_JOB_ID
//! and SLURM_STEP_ID.

use std::fmt;

/// A SLURM variable that is missing or does not say what srun would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmError {
    #[error("{var} is not set: expected {expected} (worker --slurm runs as a task started by srun)")]
    Missing { var: &'static str, expected: &'static str },
    #[error("{var}={value}: expected {expected}")]
    Invalid { var: &'static str, value: String, expected: String },
}

/// The most hosts a node list may expand to: larger than any machine SLURM
/// runs, small enough that `n[0-999999999]` is an error, not an allocation.
pub const MAX_HOSTS: usize = 1 << 20;

/// Expands SLURM's compressed hostlist: hosts separated by commas (or
/// whitespace) at the top level, each a name with any number of bracket
/// groups of comma-separated numbers and ranges, `node[01-04,07]`; several
/// groups in one name are their cartesian product, the leftmost varying
/// slowest (`rack[1-2]-n[1-2]`: rack1-n1, rack1-n2, rack2-n1, rack2-n2). A
/// range keeps the lower bound's digit count (`[08-10]`: 08, 09, 10).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for expr in split_top_level(list)? {
        let mut names = vec![String::new()];
        let mut rest = expr.as_str();
        while !rest.is_empty() {
            let (literal, group) = match rest.find('[') {
                Some(open) => {
                    let close =
                        rest[open..].find(']').map(|c| open + c).expect("split_top_level balanced it");
                    (&rest[..open], Some(&rest[open + 1..close]))
                }
                None => (rest, None),
            };
            for n in names.iter_mut() {
                n.push_str(literal);
            }
            let Some(group) = group else { break };
            let numbers = expand_group(group).map_err(|e| format!("{expr}: [{group}]: {e}"))?;
            if names.len().saturating_mul(numbers.len()).saturating_add(hosts.len()) > MAX_HOSTS {
                return Err(format!("{expr}: expands to more than {MAX_HOSTS} hosts"));
            }
            names = names.iter().flat_map(|n| numbers.iter().map(move |x| format!("{n}{x}"))).collect();
            rest = &rest[literal.len() + group.len() + 2..];
        }
        hosts.extend(names);
    }
    if hosts.is_empty() {
        return Err("names no host".into());
    }
    Ok(hosts)
}

/// Host expressions: split at commas and whitespace outside brackets.
fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0usize);
    for c in list.chars() {
        match c {
            '[' if depth > 0 => return Err(format!("{cur}[: brackets do not nest")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("{cur}]: a ']' without its '['")),
            ']' => depth = 0,
            ',' | ' ' | '\t' | '\n' if depth == 0 => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                continue;
            }
            ' ' | '\t' | '\n' => return Err(format!("{cur}: whitespace inside brackets")),
            _ => {}
        }
        cur.push(c);
    }
    if depth > 0 {
        return Err(format!("{cur}: a '[' without its ']'"));
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

/// `01-04,07` → ["01", "02", "03", "04", "07"].
fn expand_group(group: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in group.split(',') {
        let digits = |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|b| b.is_ascii_digit());
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        if !digits(lo) || !digits(hi) {
            return Err(format!("{item:?}: expected a number or a range LO-HI of numbers"));
        }
        let (a, b): (u64, u64) = (lo.parse().expect("digits"), hi.parse().expect("digits"));
        if b < a {
            return Err(format!("{item}: the range ends below its start"));
        }
        if (b - a) as usize >= MAX_HOSTS {
            return Err(format!("{item}: more than {MAX_HOSTS} numbers"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|x| format!("{x:0width$}")));
    }
    Ok(out)
}

/// SLURM_TASKS_PER_NODE's syntax: `2(x3),1` → [2, 2, 2, 1]; every count at least 1.
pub fn expand_tasks_per_node(text: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in text.trim().split(',') {
        let (count, times) = match item.split_once("(x") {
            Some((c, t)) => {
                let t = t.strip_suffix(')').ok_or_else(|| format!("{item:?}: expected N(xM)"))?;
                (c, t)
            }
            None => (item, "1"),
        };
        let number = |s: &str| s.parse::<usize>().ok().filter(|n| (1..=MAX_HOSTS).contains(n));
        let (Some(count), Some(times)) = (number(count), number(times)) else {
            return Err(format!("{item:?}: expected N or N(xM), with N and M at least 1"));
        };
        if out.len() + times > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} nodes"));
        }
        out.extend(std::iter::repeat_n(count, times));
    }
    Ok(out)
}

/// The port rank 0 listens on when `--port` is not given: an even port in
/// 20000..=29998 (the data link takes the next one), from the job id. Below
/// Linux's ephemeral range (32768 and up), so no outgoing connection holds
/// it; two jobs on one node get one port only when their ids differ by a
/// multiple of 5,000. Concurrent steps of one job share the id: give them
/// each a --port.
pub fn default_port(job_id: u64) -> u16 {
    20_000 + 2 * (job_id % 5_000) as u16
}

/// Where this task stands in its step, as srun set it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmTask {
    pub job_id: u64,
    pub step_id: Option<String>,
    /// SLURM_PROCID.
    pub rank: usize,
    /// SLURM_NTASKS.
    pub ntasks: usize,
    /// SLURM_LOCALID: this task's index among the tasks of its node.
    pub local_id: usize,
    /// SLURM_NODEID: this task's node, an index into `nodes`.
    pub node_id: Option<usize>,
    /// The step's nodes, expanded, and the variable they came from.
    pub nodes: Vec<String>,
    pub nodes_from: &'static str,
    /// Tasks per node, one entry per node of `nodes`.
    pub tasks_per_node: Vec<usize>,
}

/// The variables the node list is read from, first found wins: the step's
/// own list, then the allocation's (which equals it for a step over the
/// whole allocation).
pub const NODELIST_VARS: [&str; 3] = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"];
pub const TASKS_PER_NODE_VARS: [&str; 2] = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"];

/// The first of `vars` that is set, with its name; missing: the first is named.
fn first_set(
    var: &dyn Fn(&str) -> Option<String>,
    vars: &[&'static str],
    expected: &'static str,
) -> Result<(&'static str, String), SlurmError> {
    vars.iter().find_map(|&v| var(v).map(|l| (v, l))).ok_or(SlurmError::Missing { var: vars[0], expected })
}

impl SlurmTask {
    /// Reads and cross-checks srun's variables through `var`.
    pub fn read(var: &dyn Fn(&str) -> Option<String>) -> Result<SlurmTask, SlurmError> {
        let number = |name: &'static str, expected: &'static str| -> Result<usize, SlurmError> {
            let v = var(name).ok_or(SlurmError::Missing { var: name, expected })?;
            v.trim().parse().map_err(|_| SlurmError::Invalid {
                var: name,
                value: v,
                expected: expected.into(),
            })
        };
        let job = var("SLURM_JOB_ID")
            .ok_or(SlurmError::Missing { var: "SLURM_JOB_ID", expected: "the job's numeric id" })?;
        let job_id = job.trim().parse::<u64>().map_err(|_| SlurmError::Invalid {
            var: "SLURM_JOB_ID",
            value: job.clone(),
            expected: "the job's numeric id".into(),
        })?;
        let rank = number("SLURM_PROCID", "this task's rank, a number")?;
        let ntasks = number("SLURM_NTASKS", "the number of tasks in the step, at least 1")?;
        if ntasks == 0 {
            return Err(SlurmError::Invalid {
                var: "SLURM_NTASKS",
                value: "0".into(),
                expected: "the number of tasks in the step, at least 1".into(),
            });
        }
        if rank >= ntasks {
            return Err(SlurmError::Invalid {
                var: "SLURM_PROCID",
                value: rank.to_string(),
                expected: format!("a rank below SLURM_NTASKS={ntasks}"),
            });
        }
        let local_id = number("SLURM_LOCALID", "this task's rank on its node, a number")?;
        let (nodes_from, list) = first_set(var, &NODELIST_VARS, "the step's node list")?;
        let nodes = expand_hostlist(&list).map_err(|e| SlurmError::Invalid {
            var: nodes_from,
            value: list.clone(),
            expected: format!("a SLURM hostlist such as node[01-04,07] ({e})"),
        })?;
        let (tasks_from, tasks_text) = first_set(var, &TASKS_PER_NODE_VARS, "the tasks on each node")?;
        let tasks_per_node = expand_tasks_per_node(&tasks_text).map_err(|e| SlurmError::Invalid {
            var: tasks_from,
            value: tasks_text.clone(),
            expected: format!("counts such as 2(x3),1 ({e})"),
        })?;
        if tasks_per_node.len() != nodes.len() {
            return Err(SlurmError::Invalid {
                var: tasks_from,
                value: tasks_text,
                expected: format!(
                    "one count per node of {nodes_from} ({} nodes), not {}",
                    nodes.len(),
                    tasks_per_node.len()
                ),
            });
        }
        let sum: usize = tasks_per_node.iter().sum();
        if sum != ntasks {
            return Err(SlurmError::Invalid {
                var: tasks_from,
                value: tasks_text,
                expected: format!("counts summing to SLURM_NTASKS={ntasks}, not {sum}"),
            });
        }
        let node_id = match var("SLURM_NODEID") {
            None => None,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n < nodes.len() => Some(n),
                _ => {
                    return Err(SlurmError::Invalid {
                        var: "SLURM_NODEID",
                        value: v,
                        expected: format!(
                            "this task's node, an index below the {} nodes of {nodes_from}",
                            nodes.len()
                        ),
                    })
                }
            },
        };
        if let Some(n) = node_id {
            if local_id >= tasks_per_node[n] {
                return Err(SlurmError::Invalid {
                    var: "SLURM_LOCALID",
                    value: local_id.to_string(),
                    expected: format!(
                        "a rank below the {} tasks of node {} ({tasks_from})",
                        tasks_per_node[n], nodes[n]
                    ),
                });
            }
        }
        let step_id = var("SLURM_STEP_ID");
        Ok(SlurmTask { job_id, step_id, rank, ntasks, local_id, node_id, nodes, nodes_from, tasks_per_node })
    }

    /// The node rank `rank` runs on under srun's default block distribution
    /// (tasks fill each node in turn). Task 0 is on the step's first node
    /// under every distribution but `arbitrary`.
    pub fn node_of(&self, rank: usize) -> Option<&str> {
        let mut first = 0;
        for (node, &n) in self.nodes.iter().zip(&self.tasks_per_node) {
            if rank < first + n {
                return Some(node);
            }
            first += n;
        }
        None
    }

    /// The rendezvous: rank 0's node. Rank 0 itself checks that it runs
    /// there (SLURM_NODEID 0), so a step whose task 0 landed elsewhere
    /// (`--distribution=arbitrary`) is an error instead of a hang.
    pub fn rendezvous_host(&self) -> Result<&str, SlurmError> {
        if self.rank == 0 {
            if let Some(n) = self.node_id.filter(|&n| n != 0) {
                return Err(SlurmError::Invalid {
                    var: "SLURM_NODEID",
                    value: n.to_string(),
                    expected: format!(
                        "0 for rank 0: the other ranks look for it on the step's first node, {} ({}); \
                         with another task layout pass --join HOST:PORT",
                        self.nodes[0], self.nodes_from
                    ),
                });
            }
        }
        Ok(self.node_of(0).expect("checked: at least one task"))
    }

    /// This task's node by SLURM_NODEID, else by block distribution.
    pub fn this_node(&self) -> Option<&str> {
        match self.node_id {
            Some(n) => self.nodes.get(n).map(|s| s.as_str()),
            None => self.node_of(self.rank),
        }
    }

    /// Tasks sharing this task's node, when SLURM_NODEID says which it is.
    pub fn tasks_here(&self) -> Option<usize> {
        self.node_id.map(|n| self.tasks_per_node[n])
    }
}

impl fmt::Display for SlurmTask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SLURM job {}", self.job_id)?;
        if let Some(s) = &self.step_id {
            write!(f, " step {s}")?;
        }
        write!(
            f,
            ", task {} of {} (local id {}) on {}",
            self.rank,
            self.ntasks,
            self.local_id,
            self.this_node().unwrap_or("?")
        )
    }
}

/// What to do with this task's view of the node's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuView {
    /// Keep CUDA_VISIBLE_DEVICES as it is; the reason, for the log.
    Keep(String),
    /// Narrow CUDA_VISIBLE_DEVICES to this list: the task's share.
    Narrow(String),
    /// Kept, though the node's tasks may now share GPUs: worth a warning.
    Uneven(String),
}

/// Which GPUs this task drives. srun hands a task's GPUs over in
/// CUDA_VISIBLE_DEVICES: with `--gpus-per-task` (SLURM_GPUS_PER_TASK; per-task
/// binding on current Slurm) or a `--gpu-bind` (SLURM_GPU_BIND), each task
/// sees its own GPUs only, numbered from 0 — `bound_per_task`, kept.
/// With GPUs per node and no binding, every task of a node sees all of the
/// step's GPUs there: the `tasks_here` tasks take equal consecutive shares
/// by SLURM_LOCALID (the usual `CUDA_VISIBLE_DEVICES=$SLURM_LOCALID` of
/// sbatch scripts, for any number of GPUs per task). The config's
/// `backend.devices` then index this task's view.
pub fn gpu_view(
    visible: Option<&str>,
    bound_per_task: bool,
    tasks_here: Option<usize>,
    local_id: usize,
) -> GpuView {
    let Some(visible) = visible.map(str::trim).filter(|v| !v.is_empty()) else {
        return GpuView::Keep("CUDA_VISIBLE_DEVICES is not set: SLURM allocated no GPUs to the step".into());
    };
    if bound_per_task {
        return GpuView::Keep(format!("CUDA_VISIBLE_DEVICES={visible}: srun bound this task's GPUs"));
    }
    let gpus: Vec<&str> = visible.split(',').map(str::trim).collect();
    let Some(k) = tasks_here else {
        return GpuView::Keep(format!(
            "CUDA_VISIBLE_DEVICES={visible}: SLURM_NODEID unset, tasks per node unknown"
        ));
    };
    if k <= 1 {
        return GpuView::Keep(format!("CUDA_VISIBLE_DEVICES={visible}: the only task on its node"));
    }
    if gpus.len() < k {
        return GpuView::Keep(format!(
            "CUDA_VISIBLE_DEVICES={visible}: fewer GPUs than the node's {k} tasks, so srun bound them per task"
        ));
    }
    if !gpus.len().is_multiple_of(k) {
        return GpuView::Uneven(format!(
            "CUDA_VISIBLE_DEVICES={visible}: {} GPUs cannot be shared evenly by the node's {k} tasks \
             (ask srun for --gpus-per-task, or set backend.devices per rank)",
            gpus.len()
        ));
    }
    let per = gpus.len() / k;
    GpuView::Narrow(gpus[local_id * per..(local_id + 1) * per].join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn hosts(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn the_documented_hostlists_expand_as_slurm_expands_them() {
        // srun(1)/scontrol(1): `tux[0-5,12,20-25]`, `linux[1-3,6]`, `node1,node[2-5,12]`.
        assert_eq!(hosts("linux[1-3,6]"), ["linux1", "linux2", "linux3", "linux6"]);
        assert_eq!(hosts("node1,node[2-5,12]"), ["node1", "node2", "node3", "node4", "node5", "node12"]);
        assert_eq!(hosts("tux[0-5,12,20-25]").len(), 13);
        assert_eq!(hosts("node[01-04,07]"), ["node01", "node02", "node03", "node04", "node07"]);
        // Suffixes after a group, and plain names beside bracketed ones.
        assert_eq!(hosts("a[1-2]-ib,b3"), ["a1-ib", "a2-ib", "b3"]);
        assert_eq!(hosts("localhost"), ["localhost"]);
        // Whitespace separates hosts too.
        assert_eq!(hosts("n1 n[2-3]"), ["n1", "n2", "n3"]);
    }

    #[test]
    fn zero_padding_follows_the_lower_bound_and_groups_multiply() {
        assert_eq!(hosts("n[08-11]"), ["n08", "n09", "n10", "n11"]);
        assert_eq!(hosts("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(
            hosts("rack[1-2]-node[01-02]"),
            ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]
        );
        assert_eq!(hosts("r[1-2]n[3,5],x"), ["r1n3", "r1n5", "r2n3", "r2n5", "x"]);
    }

    #[test]
    fn malformed_hostlists_are_errors_that_say_what_is_wrong() {
        for (list, says) in [
            ("node[1-4", "without its ']'"),
            ("node1-4]", "without its '['"),
            ("node[[1-2]]", "do not nest"),
            ("node[4-1]", "ends below its start"),
            ("node[]", "expected a number"),
            ("node[a-b]", "expected a number"),
            ("node[1-]", "expected a number"),
            ("node[1,,2]", "expected a number"),
            ("node[1 - 2]", "whitespace inside brackets"),
            ("", "names no host"),
            (" , ", "names no host"),
            ("n[0-999999999]", "more than"),
            ("a[0-1023]b[0-1023]c[0-1]", "more than"),
        ] {
            let e = expand_hostlist(list).expect_err(list);
            assert!(e.contains(says), "{list:?}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_expand_repeats() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert_eq!(expand_tasks_per_node("1,3(x2)").unwrap(), [1, 3, 3]);
        for bad in ["", "0", "2(x0)", "2(x3", "2x3", "-1", "2(x3),", "a"] {
            assert!(expand_tasks_per_node(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// srun's variables for task `rank` of a block-distributed step.
    fn step(nodes: &str, tasks: &str, ntasks: usize, rank: usize) -> BTreeMap<&'static str, String> {
        let per = expand_tasks_per_node(tasks).unwrap();
        let (mut node, mut first) = (0, 0);
        while rank >= first + per[node] {
            first += per[node];
            node += 1;
        }
        BTreeMap::from([
            ("SLURM_JOB_ID", "123456".to_string()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", ntasks.to_string()),
            ("SLURM_LOCALID", (rank - first).to_string()),
            ("SLURM_NODEID", node.to_string()),
            ("SLURM_STEP_NODELIST", nodes.into()),
            ("SLURM_STEP_TASKS_PER_NODE", tasks.into()),
        ])
    }

    fn read(env: &BTreeMap<&'static str, String>) -> Result<SlurmTask, SlurmError> {
        SlurmTask::read(&|v| env.get(v).cloned())
    }

    #[test]
    fn ranks_map_to_nodes_block_wise_and_rank_0_s_node_is_the_rendezvous() {
        let env = step("gpu[07-09],gpu12", "2(x3),1", 7, 5);
        let t = read(&env).unwrap();
        assert_eq!(t.nodes, ["gpu07", "gpu08", "gpu09", "gpu12"]);
        assert_eq!((t.rank, t.ntasks, t.local_id, t.node_id), (5, 7, 1, Some(2)));
        let on: Vec<&str> = (0..7).map(|r| t.node_of(r).unwrap()).collect();
        assert_eq!(on, ["gpu07", "gpu07", "gpu08", "gpu08", "gpu09", "gpu09", "gpu12"]);
        assert_eq!(t.node_of(7), None);
        assert_eq!(t.rendezvous_host().unwrap(), "gpu07");
        assert_eq!(t.this_node(), Some("gpu09"));
        assert_eq!(t.tasks_here(), Some(2));
        assert_eq!(t.to_string(), "SLURM job 123456 step 0, task 5 of 7 (local id 1) on gpu09");
    }

    #[test]
    fn the_step_s_node_list_wins_over_the_job_s() {
        let mut env = step("n[1-2]", "1(x2)", 2, 1);
        env.insert("SLURM_JOB_NODELIST", "n[1-8]".into());
        env.insert("SLURM_NODELIST", "n[1-8]".into());
        env.insert("SLURM_TASKS_PER_NODE", "1(x8)".into());
        let t = read(&env).unwrap();
        assert_eq!((t.nodes.len(), t.nodes_from), (2, "SLURM_STEP_NODELIST"));
        // Without the step's variables, the allocation's are read.
        env.remove("SLURM_STEP_NODELIST");
        env.remove("SLURM_STEP_TASKS_PER_NODE");
        env.insert("SLURM_NTASKS", "8".into());
        let t = read(&env).unwrap();
        assert_eq!((t.nodes.len(), t.nodes_from), (8, "SLURM_JOB_NODELIST"));
    }

    #[test]
    fn partial_or_contradictory_variables_are_errors_naming_the_variable() {
        let base = step("n[1-2]", "2(x2)", 4, 1);
        let cases: [(&str, Option<&str>, &str); 12] = [
            ("SLURM_PROCID", Some("4"), "SLURM_PROCID=4: expected a rank below SLURM_NTASKS=4"),
            ("SLURM_PROCID", None, "SLURM_PROCID is not set"),
            ("SLURM_NTASKS", Some("four"), "SLURM_NTASKS=four: expected"),
            (
                "SLURM_NTASKS",
                Some("5"),
                "SLURM_STEP_TASKS_PER_NODE=2(x2): expected counts summing to SLURM_NTASKS=5, not 4",
            ),
            ("SLURM_JOB_ID", None, "SLURM_JOB_ID is not set"),
            ("SLURM_JOB_ID", Some("12_3"), "SLURM_JOB_ID=12_3: expected the job's numeric id"),
            ("SLURM_LOCALID", None, "SLURM_LOCALID is not set"),
            ("SLURM_LOCALID", Some("2"), "SLURM_LOCALID=2: expected a rank below the 2 tasks of node n1"),
            ("SLURM_STEP_NODELIST", Some("n[1-2"), "SLURM_STEP_NODELIST=n[1-2: expected a SLURM hostlist"),
            (
                "SLURM_STEP_NODELIST",
                Some("n[1-3]"),
                "expected one count per node of SLURM_STEP_NODELIST (3 nodes), not 2",
            ),
            (
                "SLURM_STEP_TASKS_PER_NODE",
                Some("2(x2"),
                "SLURM_STEP_TASKS_PER_NODE=2(x2: expected counts such as",
            ),
            ("SLURM_NODEID", Some("2"), "SLURM_NODEID=2: expected this task's node"),
        ];
        for (var, value, says) in cases {
            let mut env = base.clone();
            match value {
                Some(v) => env.insert(var, v.into()),
                None => env.remove(var),
            };
            let e = read(&env).expect_err(var).to_string();
            assert!(e.contains(says), "{var}={value:?}: {e}");
        }
        let mut env = base.clone();
        env.remove("SLURM_STEP_NODELIST");
        assert!(read(&env).unwrap_err().to_string().starts_with("SLURM_STEP_NODELIST is not set"));
    }

    #[test]
    fn rank_0_off_the_first_node_is_refused_naming_slurm_nodeid() {
        let mut env = step("n[1-2]", "1(x2)", 2, 0);
        env.insert("SLURM_NODEID", "1".into());
        env.insert("SLURM_LOCALID", "0".into());
        let e = read(&env).unwrap().rendezvous_host().unwrap_err().to_string();
        assert!(e.starts_with("SLURM_NODEID=1: expected 0 for rank 0") && e.contains("--join"), "{e}");
        // Other ranks may sit anywhere (cyclic distribution).
        let mut env = step("n[1-2]", "1(x2)", 2, 1);
        env.insert("SLURM_NODEID", "0".into());
        assert_eq!(read(&env).unwrap().rendezvous_host().unwrap(), "n1");
    }

    #[test]
    fn default_ports_are_even_below_the_ephemeral_range_and_differ_for_nearby_jobs() {
        assert_eq!(default_port(0), 20_000);
        assert_eq!(default_port(123_456), 20_000 + 2 * 3_456);
        let ports: std::collections::BTreeSet<u16> = (1_000_000..1_005_000).map(default_port).collect();
        assert_eq!(ports.len(), 5_000);
        assert!(ports.iter().all(|p| p % 2 == 0 && (20_000..=29_998).contains(p)));
        assert_eq!(default_port(u64::MAX), 20_000 + 2 * (u64::MAX % 5_000) as u16);
    }

    #[test]
    fn each_task_takes_its_share_of_an_unbound_node_s_gpus_by_local_id() {
        assert_eq!(gpu_view(Some("0,1,2,3"), false, Some(4), 2), GpuView::Narrow("2".into()));
        assert_eq!(gpu_view(Some("0,1,2,3"), false, Some(2), 1), GpuView::Narrow("2,3".into()));
        // UUIDs and a cgroup's renumbering are entries like any other.
        assert_eq!(gpu_view(Some("GPU-a,GPU-b"), false, Some(2), 0), GpuView::Narrow("GPU-a".into()));
        // srun bound the task's GPUs, one task per node, no GPUs: kept.
        for (visible, bound, here, why) in [
            (Some("0"), true, Some(4), "srun bound"),
            (Some("0,1,2,3"), false, Some(1), "the only task"),
            (None, false, Some(4), "not set"),
            (Some("0"), false, Some(4), "fewer GPUs than the node's 4 tasks"),
            (Some("0,1"), false, None, "SLURM_NODEID unset"),
        ] {
            match gpu_view(visible, bound, here, 0) {
                GpuView::Keep(r) => assert!(r.contains(why), "{visible:?}: {r}"),
                other => panic!("{visible:?} {bound} {here:?}: {other:?}"),
            }
        }
        match gpu_view(Some("0,1,2"), false, Some(2), 1) {
            GpuView::Uneven(r) => {
                assert!(r.contains("3 GPUs cannot be shared evenly by the node's 2 tasks"), "{r}")
            }
            other => panic!("{other:?}"),
        }
    }
}
