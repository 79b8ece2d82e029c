//! `struct cudaDeviceProp` as CUDA 13's `driver_types.h` lays it out (1008
//! bytes; `tests/layout.rs` compares every offset with the header's where
//! the header and a C compiler are there).

#![allow(non_snake_case)] // the header's field names

use std::ffi::{c_char, c_int, c_uint};

/// `cudaDeviceProp` (CUDA 13).
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(missing_docs)] // each field is the header's of the same name
pub struct DeviceProp {
    pub name: [c_char; 256],
    pub uuid: [u8; 16],
    pub luid: [c_char; 8],
    pub luidDeviceNodeMask: c_uint,
    pub totalGlobalMem: usize,
    pub sharedMemPerBlock: usize,
    pub regsPerBlock: c_int,
    pub warpSize: c_int,
    pub memPitch: usize,
    pub maxThreadsPerBlock: c_int,
    pub maxThreadsDim: [c_int; 3],
    pub maxGridSize: [c_int; 3],
    pub totalConstMem: usize,
    pub major: c_int,
    pub minor: c_int,
    pub textureAlignment: usize,
    pub texturePitchAlignment: usize,
    pub multiProcessorCount: c_int,
    pub integrated: c_int,
    pub canMapHostMemory: c_int,
    pub maxTexture1D: c_int,
    pub maxTexture1DMipmap: c_int,
    pub maxTexture2D: [c_int; 2],
    pub maxTexture2DMipmap: [c_int; 2],
    pub maxTexture2DLinear: [c_int; 3],
    pub maxTexture2DGather: [c_int; 2],
    pub maxTexture3D: [c_int; 3],
    pub maxTexture3DAlt: [c_int; 3],
    pub maxTextureCubemap: c_int,
    pub maxTexture1DLayered: [c_int; 2],
    pub maxTexture2DLayered: [c_int; 3],
    pub maxTextureCubemapLayered: [c_int; 2],
    pub maxSurface1D: c_int,
    pub maxSurface2D: [c_int; 2],
    pub maxSurface3D: [c_int; 3],
    pub maxSurface1DLayered: [c_int; 2],
    pub maxSurface2DLayered: [c_int; 3],
    pub maxSurfaceCubemap: c_int,
    pub maxSurfaceCubemapLayered: [c_int; 2],
    pub surfaceAlignment: usize,
    pub concurrentKernels: c_int,
    pub ECCEnabled: c_int,
    pub pciBusID: c_int,
    pub pciDeviceID: c_int,
    pub pciDomainID: c_int,
    pub tccDriver: c_int,
    pub asyncEngineCount: c_int,
    pub unifiedAddressing: c_int,
    pub memoryBusWidth: c_int,
    pub l2CacheSize: c_int,
    pub persistingL2CacheMaxSize: c_int,
    pub maxThreadsPerMultiProcessor: c_int,
    pub streamPrioritiesSupported: c_int,
    pub globalL1CacheSupported: c_int,
    pub localL1CacheSupported: c_int,
    pub sharedMemPerMultiprocessor: usize,
    pub regsPerMultiprocessor: c_int,
    pub managedMemory: c_int,
    pub isMultiGpuBoard: c_int,
    pub multiGpuBoardGroupID: c_int,
    pub hostNativeAtomicSupported: c_int,
    pub pageableMemoryAccess: c_int,
    pub concurrentManagedAccess: c_int,
    pub computePreemptionSupported: c_int,
    pub canUseHostPointerForRegisteredMem: c_int,
    pub cooperativeLaunch: c_int,
    pub sharedMemPerBlockOptin: usize,
    pub pageableMemoryAccessUsesHostPageTables: c_int,
    pub directManagedMemAccessFromHost: c_int,
    pub maxBlocksPerMultiProcessor: c_int,
    pub accessPolicyMaxWindowSize: c_int,
    pub reservedSharedMemPerBlock: usize,
    pub hostRegisterSupported: c_int,
    pub sparseCudaArraySupported: c_int,
    pub hostRegisterReadOnlySupported: c_int,
    pub timelineSemaphoreInteropSupported: c_int,
    pub memoryPoolsSupported: c_int,
    pub gpuDirectRDMASupported: c_int,
    pub gpuDirectRDMAFlushWritesOptions: c_uint,
    pub gpuDirectRDMAWritesOrdering: c_int,
    pub memoryPoolSupportedHandleTypes: c_uint,
    pub deferredMappingCudaArraySupported: c_int,
    pub ipcEventSupported: c_int,
    pub clusterLaunch: c_int,
    pub unifiedFunctionPointers: c_int,
    pub deviceNumaConfig: c_int,
    pub deviceNumaId: c_int,
    pub mpsEnabled: c_int,
    pub hostNumaId: c_int,
    pub gpuPciDeviceID: c_uint,
    pub gpuPciSubsystemID: c_uint,
    pub hostNumaMultinodeIpcSupported: c_int,
    pub reserved: [c_int; 56],
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

    use super::DeviceProp;
    use std::mem::offset_of;

    macro_rules! offsets {
        ($($f:ident),* $(,)?) => {
            vec![$((stringify!($f), offset_of!(DeviceProp, $f))),*]
        };
    }

    /// Every field's offset and the size, as the CUDA 13 header of the
    /// torch venv lays them out, compiled by the C compiler (where the venv
    /// was there when this package was built; else this test only checks
    /// the size the header had when the face was written).
    #[test]
    fn device_prop_has_the_headers_layout() {
        let ours = offsets!(
            name,
            uuid,
            luid,
            luidDeviceNodeMask,
            totalGlobalMem,
            sharedMemPerBlock,
            regsPerBlock,
            warpSize,
            memPitch,
            maxThreadsPerBlock,
            maxThreadsDim,
            maxGridSize,
            totalConstMem,
            major,
            minor,
            textureAlignment,
            texturePitchAlignment,
            multiProcessorCount,
            integrated,
            canMapHostMemory,
            maxTexture1D,
            maxTexture1DMipmap,
            maxTexture2D,
            maxTexture2DMipmap,
            maxTexture2DLinear,
            maxTexture2DGather,
            maxTexture3D,
            maxTexture3DAlt,
            maxTextureCubemap,
            maxTexture1DLayered,
            maxTexture2DLayered,
            maxTextureCubemapLayered,
            maxSurface1D,
            maxSurface2D,
            maxSurface3D,
            maxSurface1DLayered,
            maxSurface2DLayered,
            maxSurfaceCubemap,
            maxSurfaceCubemapLayered,
            surfaceAlignment,
            concurrentKernels,
            ECCEnabled,
            pciBusID,
            pciDeviceID,
            pciDomainID,
            tccDriver,
            asyncEngineCount,
            unifiedAddressing,
            memoryBusWidth,
            l2CacheSize,
            persistingL2CacheMaxSize,
            maxThreadsPerMultiProcessor,
            streamPrioritiesSupported,
            globalL1CacheSupported,
            localL1CacheSupported,
            sharedMemPerMultiprocessor,
            regsPerMultiprocessor,
            managedMemory,
            isMultiGpuBoard,
            multiGpuBoardGroupID,
            hostNativeAtomicSupported,
            pageableMemoryAccess,
            concurrentManagedAccess,
            computePreemptionSupported,
            canUseHostPointerForRegisteredMem,
            cooperativeLaunch,
            sharedMemPerBlockOptin,
            pageableMemoryAccessUsesHostPageTables,
            directManagedMemAccessFromHost,
            maxBlocksPerMultiProcessor,
            accessPolicyMaxWindowSize,
            reservedSharedMemPerBlock,
            hostRegisterSupported,
            sparseCudaArraySupported,
            hostRegisterReadOnlySupported,
            timelineSemaphoreInteropSupported,
            memoryPoolsSupported,
            gpuDirectRDMASupported,
            gpuDirectRDMAFlushWritesOptions,
            gpuDirectRDMAWritesOrdering,
            memoryPoolSupportedHandleTypes,
            deferredMappingCudaArraySupported,
            ipcEventSupported,
            clusterLaunch,
            unifiedFunctionPointers,
            deviceNumaConfig,
            deviceNumaId,
            mpsEnabled,
            hostNumaId,
            gpuPciDeviceID,
            gpuPciSubsystemID,
            hostNumaMultinodeIpcSupported,
            reserved
        );
        assert_eq!(std::mem::size_of::<DeviceProp>(), 1008);
        let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
            return;
        };
        let include = std::fs::read_dir(std::path::Path::new(venv).join("lib"))
            .unwrap()
            .map(|e| e.unwrap().path().join("site-packages/nvidia/cu13/include"))
            .find(|p| p.join("driver_types.h").exists())
            .expect("the CUDA 13 headers in the venv");
        let dir =
            std::env::temp_dir().join(format!("quilt-cuda-runtime-layout-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("crt")).unwrap();
        // driver_types.h includes crt/host_defines.h, which the wheel lacks:
        // the few attribute macros it defines, as a C compiler needs them.
        std::fs::write(
            dir.join("crt/host_defines.h"),
            "#define __device_builtin__\n#define __host__\n#define __device__\n#define __cudart_builtin__\n#define CUDARTAPI\n#define __dv(v)\n#define __builtin_align__(a) __attribute__((aligned(a)))\n#define __align__(a) __attribute__((aligned(a)))\n#define CUDART_CB\n",
        )
        .unwrap();
        let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <driver_types.h>\nint main(void) {\n");
        c.push_str("printf(\"size %zu\\n\", sizeof(struct cudaDeviceProp));\n");
        for (name, _) in &ours {
            c.push_str(&format!(
                "printf(\"{name} %zu\\n\", offsetof(struct cudaDeviceProp, {name}));\n"
            ));
        }
        c.push_str("return 0; }\n");
        std::fs::write(dir.join("layout.c"), c).unwrap();
        let exe = dir.join("layout");
        let cc = std::process::Command::new("cc")
            .arg(format!("-I{}", dir.display()))
            .arg(format!("-I{}", include.display()))
            .arg(dir.join("layout.c"))
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("a C compiler (cc)");
        assert!(
            cc.status.success(),
            "{}",
            String::from_utf8_lossy(&cc.stderr)
        );
        let out = std::process::Command::new(&exe).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let _ = std::fs::remove_dir_all(&dir);
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some("size 1008"), "{text}");
        for ((name, offset), line) in ours.iter().zip(lines) {
            assert_eq!(
                line,
                format!("{name} {offset}"),
                "the header's offset of {name}"
            );
        }
    }
}
